"""A step load that walks from light load past saturation; add it to any user's locustfile.

    locust -f locustfiles/grpc_stream_user.py,locustfiles/step_load.py --headless --host 127.0.0.1:8001 \
        --model continuous_batching --step-users 8 --step-time 60 --steps 10

Users step up by `--step-users` every `--step-time` seconds, `--steps` times, then the test ends. Steps
of 8 keep static_batching (which answers only full batches of 8) from holding a partial batch. Every
model runs 8 sequences at once, so from the second step on requests queue (saturation); past 72 users
static and dynamic batching refuse requests (64 waiting + 8 running), continuous batching past 264 (256
waiting), and those rejections show as failures.
"""

from __future__ import annotations

import os

import common  # noqa: F401  (registers the shared options)
from locust import LoadTestShape, events


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    """The shape's arguments (web UI and workers too)."""
    env = os.environ.get
    parser.add_argument("--step-users", type=int, default=int(env("BATCHLM_STEP_USERS", "8")),
                        help="users added per step [env BATCHLM_STEP_USERS]")
    parser.add_argument("--step-time", type=float, default=float(env("BATCHLM_STEP_TIME", "60")),
                        help="seconds per step [env BATCHLM_STEP_TIME]")
    parser.add_argument("--steps", type=int, default=int(env("BATCHLM_STEPS", "10")),
                        help="number of steps; the test stops after the last [env BATCHLM_STEPS]")


class StepLoadShape(LoadTestShape):
    """step_users, 2*step_users, ... steps*step_users users, each level held for step_time seconds."""

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        step = int(self.get_run_time() // options.step_time)
        if step >= options.steps:
            return None
        users = (step + 1) * options.step_users
        return users, float(users)  # spawn rate: reach each level at once
