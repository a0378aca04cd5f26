"""The effect journal (docs/effects.md): tool calls with an effect outside Gym, recorded in the
ledger so that a restore never makes them act twice."""
