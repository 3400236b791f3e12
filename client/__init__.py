"""batchlm_client: the Python client of the served models (installed from this `client/` folder).

    from batchlm_client import LLMClient

    with LLMClient() as llm:
        print(llm.generate("continuous_batching", "The capital of France is", max_tokens=8).text)

`LLMClient` speaks Triton's `/generate`, KServe v2 `/infer` and gRPC (streamed too); `OpenAIClient` the
OpenAI-compatible frontend; `batchlm-client` (cli.py) is the command line over both.
"""

from batchlm.response_schema import Chunk
from batchlm_client.openai_client import OpenAIClient
from batchlm_client.triton_llm import LLMClient, RequestFailed, Result

__all__ = ["LLMClient", "OpenAIClient", "Chunk", "Result", "RequestFailed"]
