"""Built-in device plugins; each registers through the `polyrunner.backends` entry points."""
