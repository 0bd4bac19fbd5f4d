"""Values: the errors, compile keys, platforms and small file helpers every layer uses (imports no other layer)."""
