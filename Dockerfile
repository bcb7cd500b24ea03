# kvgate's image: `kvgate` as the entrypoint (the chart runs `kvgate serve --config ...`).
# Runs as a non-root user on a read-only root filesystem (bytecode compiled at build time).
# The `parquet` extra (pyarrow) is installed: billing exports offer Parquet.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml setup.py README.md kvgate_cli.py ./
COPY gateway gateway
COPY router router
COPY cachemap cachemap
COPY loadgen loadgen
# xds-protos (the endpoint picker's Envoy messages) overwrites opentelemetry-proto's generated
# modules with older copies: reinstall opentelemetry-proto's own (see the Makefile)
RUN pip install --no-cache-dir '.[parquet]' \
    && pip install --no-cache-dir --no-deps --force-reinstall \
       "opentelemetry-proto==$(python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
    && python -m compileall -q "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf /src
WORKDIR /
USER 10001:10001
# 8080: the APIs; 50051: gRPC (the chart's default); 9090: the admin port (/metrics, docs);
# 9002: ext-proc in endpoint-picker mode
EXPOSE 8080 50051 9090 9002
ENTRYPOINT ["kvgate"]
CMD ["serve", "--help"]
