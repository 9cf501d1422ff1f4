"""cuda backend."""
