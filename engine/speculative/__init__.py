"""Speculative decoding: proposers guess a decode row's next tokens, one target pass verifies them all.

``config``: what a user sets (``speculative_config``). ``proposers``: where guesses come from. ``speculator``:
who gets how many guesses each step (the adaptive part) and the counts ``stats()`` reports. Verification is the
sampler's (``Sampler.verify``) and the bookkeeping the scheduler's (proposals are extra scheduled tokens of a
decode row; rejected ones are rolled back by the computed-token count).
"""

from inflight.engine.speculative.config import SpeculativeConfig
from inflight.engine.speculative.speculator import Speculator, draft_budget, make_speculator

__all__ = ["SpeculativeConfig", "Speculator", "draft_budget", "make_speculator"]
