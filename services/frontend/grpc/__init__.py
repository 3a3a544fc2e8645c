"""The public gRPC Inference API and its gatekeeper."""
