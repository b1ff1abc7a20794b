# One image for both roles; docker-compose.yml picks `python -m collective.chief` or `python -m collective.worker`.
#   docker build -t collective:local .
#   docker run --rm -e COLLECTIVE_WORKERS=1 collective:local                 # the chief
#   docker run --rm -e COLLECTIVE_CHIEF=host:50051 collective:local python -m collective.worker
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package needs (the generated gRPC modules are committed in collective/_proto).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY collective ./collective
RUN pip install . \
    && cd / && rm -rf /src

# A fixed non-root uid, so a mounted models directory can be made readable for it.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin collective \
    && mkdir -p /models
USER collective
WORKDIR /home/collective

EXPOSE 50051
CMD ["python", "-m", "collective.chief"]
