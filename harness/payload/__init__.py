"""Every batch a job can be handed: generated payloads, recorded files, schemas and the
workload of shapes the calls cycle through, opened, checked and loaded once per job
(``harness.payload.generated``)."""
