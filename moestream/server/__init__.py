"""The OpenAI-compatible HTTP server of `moestream serve`: FastAPI routes in app.py, one model-owning
worker thread in worker.py, llama-server timings in timings.py. Needs the `server` extra."""
