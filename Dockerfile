# kvgate's image: `kvgate` as the entrypoint (the chart runs `kvgate serve --config ...`).
# Runs as a non-root user on a read-only root filesystem (bytecode compiled at build time).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY pyproject.toml README.md kvgate_cli.py ./
COPY gateway gateway
COPY router router
COPY cachemap cachemap
COPY loadgen loadgen
RUN pip install --no-cache-dir . \
    && python -m compileall -q "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf /src
WORKDIR /
USER 10001:10001
# 8080: the APIs; 50051: gRPC (the chart's default); 9090: the admin port (/metrics, docs)
EXPOSE 8080 50051 9090
ENTRYPOINT ["kvgate"]
CMD ["serve", "--help"]
