"""Generated from proto/redknot/store/v1/artifact_store.proto by proto/generate.py."""
