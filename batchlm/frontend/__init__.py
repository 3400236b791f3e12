"""An OpenAI-compatible HTTP frontend in front of the Triton models: it holds no model, it translates.

    .venv/bin/batchlm-frontend --triton-grpc 127.0.0.1:8001 --host 127.0.0.1 --port 9000

`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` (streamed as server-sent events
with `stream: true`) become requests of the shared request schema, sent to Triton over one asyncio gRPC
channel (`triton_client.py`). Modules: `protocol.py` (OpenAI requests -> schema fields),
`responses.py` (OpenAI response and chunk shapes), `errors.py` (OpenAI's error JSON; Triton's errors
mapped), `auth.py` (the API key, where one is given), `validation.py` (a refused body -> a 400 naming the
parameter), `chat_template.py` (messages -> prompt), `app.py` (the FastAPI app). `batchlm-serve` runs it
as a child process (batchlm/launcher/frontend_process.py). Nothing here is imported by the Triton models.
"""
