"""Real ranks: connecting a mesh to a job, transports, failures, point-to-point, native bindings."""
