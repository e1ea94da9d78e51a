"""The OpenAI-compatible HTTP API, served beside gRPC from the same process, event loop and cluster.

- options.py: the `--http-port` / `--served-model-name` flags
- app.py: the Starlette app (routes, auth, the calls through frontend/calls.py)
- requests.py: the request bodies (pydantic) and their translation into GenerateRequests
- streaming.py: the committed-prefix text release, chunks, and the SSE response
- chat_template.py: the checkpoint's chat template, rendered as Hugging Face does
- errors.py: errors in OpenAI's shape with their HTTP status
- listener.py: uvicorn on the running event loop
"""
