"""The wire: numpy columns <-> protocol messages, and the error catalog."""
