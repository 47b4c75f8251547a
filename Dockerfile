# Placeholder: the serving image is finished with the connector (deploy/ issue).
FROM python:3.11-slim
WORKDIR /opt/orbitkv
COPY . .
RUN pip install --no-cache-dir -e ".[gpu]"
ENTRYPOINT ["orbitkv", "serve", "--"]
