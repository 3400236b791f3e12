"""An OpenAI-compatible HTTP frontend in front of the Triton models: it holds no model, it translates.

    .venv/bin/batchlm-frontend --triton-grpc 127.0.0.1:8001 --host 127.0.0.1 --port 9000

`GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` (streamed as server-sent events
with `stream: true`) become requests of the shared request schema, one per choice, sent to Triton over
one asyncio gRPC channel (`triton_client.py`). Modules: `protocol.py` (OpenAI's request bodies),
`schema_request.py` (a body -> each choice's schema fields), `guides.py` (structured output -> the
schema's guide), `generate.py` (the choices' requests sent, their answers shaped into a body or a
stream), `responses.py` (OpenAI response and chunk shapes), `logprobs.py` and `token_text.py` (a
choice's text and log-probabilities), `errors.py` (OpenAI's error JSON; Triton's errors mapped),
`auth.py` (the API key, where one is given), `validation.py` (a refused body -> a 400 naming the
parameter), `served_models.py` (each model's config, tokenizer and chat template), `tokenize.py` (the
tokenizer routes), `metrics.py` (the frontend's own metrics), `app.py` (the FastAPI app).
`batchlm-serve` runs it as a child process (batchlm/launcher/frontend_process.py). Nothing here is
imported by the Triton models.
"""
