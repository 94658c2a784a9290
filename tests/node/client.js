// A Node.js client of shardtrain built from protos/ alone (@grpc/grpc-js, @grpc/proto-loader).
//
//   node client.js   (reads {"coordinator", "stages", "token", "deployment_id", "secret", "input"} as JSON on stdin)
//
// It lists the shards, describes each stage's shard, runs a forward of `input` (rows of float32) through the
// deployment with the per-call Forward RPC, fetches the last stage's output with FetchTensor, and reads the
// first stage's optimizer state with ReadOptimizerState. Prints one JSON object: what it learned, with tensors
// as {shape, dtype, base64 of their little-endian bytes}.
// protobufjs 8 is needed (package.json's override): shardtrain writes a chunk's data as a second occurrence of
// the TensorChunk field, which protobufjs 7 does not merge into the first.

"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const PROTOS = path.join(__dirname, "..", "..", "protos");
const definition = loader.loadSync(
  ["shardtrain/v1/coordinator.proto", "shardtrain/v1/shard.proto"],
  { includeDirs: [PROTOS], keepCase: true, longs: String, enums: String, defaults: true, oneofs: true });
const v1 = grpc.loadPackageDefinition(definition).shardtrain.v1;

function metadata(token, secret) {
  const meta = new grpc.Metadata();
  meta.set("authorization", `Bearer ${token}`);
  if (secret) meta.set("shardtrain-deployment", secret);
  return meta;
}

function unary(client, method, request, meta) {
  return new Promise((resolve, reject) =>
    client[method](request, meta, (error, response) => (error ? reject(error) : resolve(response))));
}

function collect(call) {
  return new Promise((resolve, reject) => {
    const messages = [];
    call.on("data", (message) => messages.push(message));
    call.on("error", reject);
    call.on("end", () => resolve(messages));
  });
}

// Chunks (with their header on the first) into {name: {shape, dtype, data}}, each chunk checked for its offset.
function assemble(chunks) {
  const tensors = {};
  let current = null;
  for (const chunk of chunks) {
    if (chunk.header) {
      current = { name: chunk.header.name, shape: chunk.header.shape.map(Number), dtype: chunk.header.dtype,
                  parts: [], filled: 0, size: Number(chunk.header.wire_nbytes) };
      tensors[current.name] = current;
    }
    if (Number(chunk.offset) !== current.filled) throw new Error(`chunk at ${chunk.offset}, expected ${current.filled}`);
    current.parts.push(chunk.data);
    current.filled += chunk.data.length;
  }
  const out = {};
  for (const [name, tensor] of Object.entries(tensors)) {
    if (tensor.filled !== tensor.size) throw new Error(`${name}: ${tensor.filled} of ${tensor.size} bytes`);
    out[name] = { shape: tensor.shape, dtype: tensor.dtype, data: Buffer.concat(tensor.parts).toString("base64") };
  }
  return out;
}

async function main() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  const args = JSON.parse(Buffer.concat(chunks).toString());
  const credentials = grpc.credentials.createInsecure();
  const plain = metadata(args.token, "");
  const owned = metadata(args.token, args.secret);

  const coordinator = new v1.CoordinatorService(args.coordinator, credentials);
  const listed = await unary(coordinator, "ListShards", {}, plain);
  const stages = args.stages.map((address) => new v1.ShardService(address, credentials));
  const described = [];
  for (const stage of stages) described.push(await unary(stage, "Describe", {}, plain));

  // Forward: the header, and the whole input as one chunk of float32 rows.
  const rows = args.input;
  const values = Float32Array.from(rows.flat());
  const data = Buffer.from(values.buffer);
  const key = { deployment_id: args.deployment_id, step: "1000000", microbatch: 0 };
  await new Promise((resolve, reject) => {
    const call = stages[0].Forward(owned, (error) => (error ? reject(error) : resolve()));
    call.write({
      header: { key, requires_grad: false },
      tensor: { header: { name: "activation", dtype: "DTYPE_FLOAT32", shape: [rows.length, rows[0].length],
                          nbytes: data.length, wire_nbytes: data.length, encoding: "ENCODING_NONE" },
                data, offset: 0 },
    });
    call.end();
  });
  const last = stages[stages.length - 1];
  const output = assemble(await collect(last.FetchTensor({ key, name: "@output" }, owned)));

  const messages = await collect(stages[0].ReadOptimizerState({ deployment_id: args.deployment_id }, owned));
  const optimizer = {
    layout: JSON.parse(messages[0].header.layout),
    tensors: assemble(messages.filter((m) => m.tensor).map((m) => m.tensor)),
  };
  console.log(JSON.stringify({
    shards: listed.shards.map((s) => s.address),
    described: described.map((d) => ({ address: d.address, stage: d.stage, deployment_id: d.deployment_id,
                                        layer_indexes: d.layer_indexes })),
    output, optimizer,
  }));
  coordinator.close();
  stages.forEach((stage) => stage.close());
}

main().catch((error) => {
  console.error(error.stack || String(error));
  process.exit(1);
});
