"""The artifact API: documents (upload, status, list, retire) and generation, over FastAPI."""
