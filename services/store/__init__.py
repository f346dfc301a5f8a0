"""The gRPC artifact store (SPEC §8); layering rules in README.md beside this file. Importing the package
imports nothing: `server.serve` builds the service, `client.StoreClient` talks to it."""
