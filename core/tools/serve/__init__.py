"""`polyrunner serve`: an OpenAI-compatible HTTP server over `AsyncLLM`.

protocol.py (request/response bodies), api_server.py (`build_app`), calls.py and
formats.py (one call, its responses), guard.py (key, content type, size),
offload.py (request work off the event loop), lora.py (served LoRA adapters),
metrics.py (Prometheus), launcher.py (uvicorn, signals), cli.py (the command).
"""
