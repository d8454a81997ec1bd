"""Scale-out policies: which trainer shard holds a model, the capacity plan, the moves toward
it, and the count of workers in service that routers follow."""
