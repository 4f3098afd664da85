from offcore.testing import BackendConformance


class TestNumpyDev(BackendConformance):
    backend_spec = "numpydev"
    backend_options = {"capacity": "64MiB"}
