"""The top of the house: the `quilt` command, the embedded launcher (`quilt up`), the Celery
worker's entry point and the tiny-model builder. Imports every other package; none imports it
(except tests and benchmarks)."""
