"""How a pull's bytes move: the transport interface (`base.py`) and one module per transport."""
