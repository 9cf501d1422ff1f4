"""Multi-LoRA: PEFT adapters served next to the base model, many in one batch (vLLM's names).

- `request.py`: `LoRARequest` (which adapter a request uses);
- `peft.py`: reading and checking a PEFT adapter folder;
- `model.py`: wrapping a model's linears in `LoRALinear` and writing an adapter into a slot;
- `manager.py`: the runner's adapter slots and its CPU cache of adapters.

The batched op itself is the "lora" role (`polyrunner.ops.lora`).
"""
