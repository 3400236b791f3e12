"""The prefix bench's chat driver (batchlm.bench.served.prefix_driver), with no server: conversations start
at their scripts' times, and each later turn goes out its think time after the previous answer."""

import time

from batchlm.bench.prefix_workload import Conversation
from batchlm.bench.served import prefix_driver
from batchlm.bench.served.prefix_driver import Answer, Driver, Target
from batchlm.model.chat_template import ChatTemplate

ANSWER_S = 0.03


class FakeClient:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def model_config(self, model: str) -> dict:
        return {}

    def close(self) -> None:
        pass


class FakeTemplate(ChatTemplate):
    def __init__(self) -> None:
        pass

    def render(self, messages, add_generation_prompt=True) -> str:
        return " | ".join(m["content"] for m in messages)


def test_chat_turns_go_out_at_their_start_and_think_times(monkeypatch):
    monkeypatch.setattr(prefix_driver, "LLMClient", FakeClient)
    monkeypatch.setattr(prefix_driver, "settled_scrape", lambda *args: {})
    sent: dict[str, tuple[float, str]] = {}

    def ask(self, llm, key, turn, prompt, max_tokens):
        start = time.perf_counter()
        sent[key] = (start - self._t0, prompt)
        time.sleep(ANSWER_S)
        return Answer(key, turn, start - self._t0, ttft=ANSWER_S, latency=ANSWER_S, text=f"answer {key}")

    monkeypatch.setattr(Driver, "_ask", ask)
    scripts = [Conversation(0, ("a?", "b?", "c?"), 0.0, (0.1, 0.0)),
               Conversation(1, ("x?", "y?"), 0.15, (0.05,))]
    run = Driver(Target("m", "http://x", "http://x/metrics", True)).chat(scripts, FakeTemplate(), 4)
    assert sorted(a.key for a in run.answers) == ["c0.t1", "c0.t2", "c0.t3", "c1.t1", "c1.t2"]
    assert [a.sent_at for a in run.answers] == sorted(a.sent_at for a in run.answers)
    at = {key: t for key, (t, _) in sent.items()}
    assert at["c0.t1"] < 0.02 and at["c1.t1"] >= 0.15
    assert at["c0.t2"] >= at["c0.t1"] + ANSWER_S + 0.1
    assert at["c0.t3"] >= at["c0.t2"] + ANSWER_S
    assert at["c1.t2"] >= at["c1.t1"] + ANSWER_S + 0.05
    assert sent["c0.t3"][1] == "a? | answer c0.t1 | b? | answer c0.t2 | c?"
