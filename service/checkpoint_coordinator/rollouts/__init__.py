"""The live rollout ledger: admit, dispatch, seal, fail and finalize, with its SQL beside it."""
