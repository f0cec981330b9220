FROM python:3.11-slim

# A C compiler for the Cython path core (trellis/ext/_paths_c.pyx), built by `pip install .`.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
RUN pip install --no-cache-dir .

# The servers come from docker-compose (TRELLIS_NATS_URL / TRELLIS_DATABASE_URL), not embedded.
CMD ["trellis", "up"]
