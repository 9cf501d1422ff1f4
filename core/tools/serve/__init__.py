"""`polyrunner serve`: an OpenAI-compatible HTTP server over `AsyncLLM`.

protocol.py (request/response bodies), api_server.py (`build_app`),
metrics.py (Prometheus), launcher.py (uvicorn, signals), cli.py (the command).
"""
