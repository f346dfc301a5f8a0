"""The build worker: consumes the build queue, runs the producer on every TP rank, uploads to the store."""
