"""Environment variables of `polyrunner serve` (read through `polyrunner.envs`; listed in the README)."""

from __future__ import annotations

from polyrunner.envs import declare

API_KEY = declare("POLYRUNNER_API_KEY", str, None,
                  "`polyrunner serve`: require 'Authorization: Bearer KEY' when --api-key is not given "
                  "(unset: the server is open)", section="serve")
