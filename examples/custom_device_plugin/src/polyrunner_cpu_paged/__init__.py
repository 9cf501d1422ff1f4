"""polyrunner-cpu-paged: an example third-party polyrunner device plugin."""

__version__ = "0.1.0"
