"""The engine's adapters: which ids are loaded (`add_lora` / `list_loras` / `remove_lora`) and
which were checked against the model, so an adapter is read and checked once per id, on the
caller's thread, before any request with it is scheduled."""

from __future__ import annotations

from polyrunner.config import LoRAConfig
from polyrunner.lora.peft import check_adapter, read_adapter
from polyrunner.lora.request import LoRARequest
from polyrunner.models.arch import DecoderArch

NOT_ENABLED = "LoRA is not enabled: start the engine with enable_lora=True (`--enable-lora`) to use lora_request"


class AdapterRegistry:
    def __init__(self, config: LoRAConfig | None, arch: DecoderArch) -> None:
        self.config, self.arch = config, arch
        self.checked: dict[int, LoRARequest] = {}    # id -> the request whose folder was checked

    def check(self, request: LoRARequest | None) -> None:
        """ValueError unless `request` is None or a readable adapter that fits the model and the limits."""
        if request is None:
            return
        if self.config is None:
            raise ValueError(NOT_ENABLED)
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.checked.get(request.lora_int_id)
        if known is not None and known.lora_path == request.lora_path:
            return
        adapter = read_adapter(request.lora_path, self.config.max_lora_rank)
        check_adapter(adapter, self.arch)
        self.checked[request.lora_int_id] = request

    def add(self, request: LoRARequest) -> bool:
        """vLLM's `add_lora`: check it now; False when that id is already loaded."""
        if request.lora_int_id in self.checked and self.checked[request.lora_int_id].lora_path == request.lora_path:
            return False
        self.check(request)
        return True

    def remove(self, lora_id: int) -> bool:
        return self.checked.pop(lora_id, None) is not None

    def ids(self) -> set[int]:
        return set(self.checked)
