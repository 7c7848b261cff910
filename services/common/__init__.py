"""Code shared by all services: configs, gRPC bootstrap, model and data kits. Light on import."""
