"""Flags of remote services: the target, the PRM and the policy's generation behind servers."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("target_url", None, "The 'target' reward's frozen solver behind OpenAI-compatible completions "
                    "servers (`vllm serve`), instead of --target_model_name_or_path: URL[,URL...]; each request "
                    "goes to the URL with the fewest in flight.")
flags.DEFINE_string("target_model_name", None, "The target's served model name (default: the one model the "
                    "--target_url servers serve).")
flags.DEFINE_string("prm_url", None, "PRM server(s) started with `python -m reward_models.serve`, instead of "
                    "--prm_model_name_or_path: URL[,URL...]. Enables the 'prm' reward source.")
flags.DEFINE_string("prm_model_name", None, "The PRM's served model name (default: the one the server serves).")
flags.DEFINE_string("vllm_url", None, "--generation_backend=vllm_server: the vLLM server(s) serving "
                    "--model_name_or_path, URL[,URL...] (see the README: LoRA policies need --enable-lora, full "
                    "fine-tuning VLLM_SERVER_DEV_MODE=1).")
flags.DEFINE_string("vllm_model_name", None, "The policy's served model name on --vllm_url (default: the one "
                    "model the servers serve).")
flags.DEFINE_string("vllm_sync_dir", None, "Where new policy weights are written for the --vllm_url servers to "
                    "load (a path they can read). Default: <run dir>/sync.")
flags.DEFINE_float("service_connect_timeout", 5.0, "Seconds to connect to a --*_url server before the attempt "
                   "counts as failed.")
flags.DEFINE_float("service_read_timeout", 300.0, "Seconds a --*_url server may stay silent on a request (a "
                   "batch of long completions takes a while) before the attempt counts as failed.")
flags.DEFINE_integer("service_retries", 4, "Retries of a request after connection errors, timeouts and HTTP "
                     "502/503/504 (never after 4xx), with exponential backoff and jitter; then the iteration fails, "
                     "its start saved.", lower_bound=0)
flags.DEFINE_float("service_backoff", 1.0, "Seconds before the first retry (doubling each time, at most 30).")
flags.DEFINE_integer("service_max_in_flight", 8, "Most requests in flight per --*_url server.", lower_bound=1)
