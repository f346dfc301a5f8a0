"""Settings of `redknot api serve`: flags, then env, then defaults."""
from __future__ import annotations

from pathlib import Path

from services.common.settings import CommonSettings, setting


class ApiSettings(CommonSettings):
    listen: str = setting("127.0.0.1:8000", "REDKNOT_API_LISTEN", "host:port of the HTTP API")
    worker_url: str = setting("http://127.0.0.1:8100", "REDKNOT_WORKER_URL", "rank 0 of the inference worker")
    max_upload_bytes: int = setting(4 << 20, "REDKNOT_API_MAX_UPLOAD_BYTES", "largest upload body")
    max_generate_bytes: int = setting(256 << 10, "REDKNOT_API_MAX_GENERATE_BYTES", "largest generate body")
    max_body_bytes: int = setting(16 << 10, "REDKNOT_API_MAX_BODY_BYTES", "largest body of any other route")
    body_timeout_s: float = setting(20.0, "REDKNOT_API_BODY_TIMEOUT_S", "longest time to receive a request body "
                                                                        "(from its first read); then 408")
    head_timeout_s: float = setting(10.0, "REDKNOT_API_HEAD_TIMEOUT_S", "longest time to receive a request line and "
                                                                        "headers; then 408 and the connection closed")
    id_secret: str = setting("", "REDKNOT_API_ID_SECRET", "the deployment's key of document ids, 64 hex digits "
                                                          "(32 bytes; `openssl rand -hex 32`): ids are keyed per "
                                                          "tenant, so a text cannot be confirmed from an id without "
                                                          "it. Every API replica needs the same; changing it renames "
                                                          "every document (uploads get new ids). Required")
    max_connections: int = setting(1024, "REDKNOT_API_MAX_CONNECTIONS", "open connections (and requests in "
                                                                        "flight) beyond which requests get 503")
    generate_concurrency: int = setting(64, "REDKNOT_API_GENERATE_CONCURRENCY", "threads of the generate routes' "
                                        "registry reads and bookkeeping (their wait on the worker holds none)")
    served_model_name: str = setting("", "REDKNOT_API_SERVED_MODEL_NAME", "the model id of /v1/models and of the "
                                                                          "OpenAI routes' `model` (default: the "
                                                                          "checkpoint directory's name)")
    max_document_tokens: int = setting(131072, "REDKNOT_API_MAX_DOCUMENT_TOKENS", "longest document, in tokens")
    max_documents: int = setting(16, "REDKNOT_API_MAX_DOCUMENTS", "most documents in one generate request")
    max_question_chars: int = setting(16384, "REDKNOT_API_MAX_QUESTION_CHARS", "longest question")
    max_new_tokens: int = setting(512, "REDKNOT_API_MAX_NEW_TOKENS", "most tokens one request may generate")
    generate_timeout_s: float = setting(600.0, "REDKNOT_API_GENERATE_TIMEOUT_S", "longest wait for the worker")

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def document_id_secret(self) -> bytes:
        """The id key, checked at start: 64 hex digits."""
        try:
            key = bytes.fromhex(self.id_secret)
        except ValueError:
            key = b""
        if len(key) != 32:
            raise SystemExit("redknot api: --id-secret (REDKNOT_API_ID_SECRET) must be 64 hex digits (32 bytes), e.g. "
                             "from `openssl rand -hex 32`; every API replica needs the same one")
        return key
