"""Running leaplm beyond one process: Ray Serve replicas (ray.py). The container, Kubernetes and Triton recipes
live in the repository's deploy/ directory."""
