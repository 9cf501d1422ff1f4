"""`LoRARequest`: the adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder under a name and a positive integer id, unique per adapter
    (requests with the same `lora_int_id` share one adapter slot and its prefix cache).
    Equal when the ids are equal, as in vLLM."""

    lora_name: str
    lora_int_id: int
    lora_path: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the adapter's folder, got {self.lora_path!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_int_id == self.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
