"""Generated from proto/millpond/v1/replay.proto by `make proto`; do not edit."""
