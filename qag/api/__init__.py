"""HTTP resources: the Management API, the runs routes and the operations routes."""
