"""xla backend."""
