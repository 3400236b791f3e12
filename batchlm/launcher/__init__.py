"""The launcher: start, probe, drain and stop a real tritonserver over the model repository."""
