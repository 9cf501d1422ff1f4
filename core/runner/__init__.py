"""The runner side: slot-indexed request state on the device's behalf, per-step
input preparation, and the model runner that executes a scheduled step."""
