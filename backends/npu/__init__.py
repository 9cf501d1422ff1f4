"""npu backend."""
