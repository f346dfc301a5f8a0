"""What the API, the builder and the workers share: settings, tenants, the serving identity, the document
registry and the build queue in Redis, the TP rank group, and the local stack that `redknot demo` starts."""
