// A Node.js client of shardtrain built from protos/ alone (@grpc/grpc-js, @grpc/proto-loader).
//
//   node client.js   (reads a JSON object on stdin; prints one JSON object, tensors as {shape, dtype, data}
//                     with data the base64 of their little-endian bytes)
//
// Always given "coordinator", "token", "deployment_id", "secret", and "ca" (a CA file: TLS on) or not (plaintext).
// - With "input" (rows of float32) and "stages" (each stage's shard address): lists the shards, describes each
//   stage's shard, runs a forward of the input with the per-call Forward RPC, fetches the last stage's output with
//   FetchTensor and reads the first stage's optimizer state with ReadOptimizerState.
// - With "batches" ([{x, y}], each a tensor as above): finds the deployment's stages (ListShards, Describe) and
//   trains on each batch with the per-call RPCs alone, the MSE loss and its gradient computed here: Forward to the
//   first stage, FetchTensor("@output") from the last, Backward there, Step to the first; step 1 also keeps and
//   fetches the input's gradient ("@input_grad"). Then a no-grad Forward after the last optimizer step (it runs
//   only once that step settled on every stage), and ReadState of every stage. It also tries calls without the
//   token, without TLS and without the deployment secret, and a FetchTensor of a residual, and reports the status
//   codes they got.
// protobufjs 8 is needed (package.json's override): shardtrain writes a chunk's data as a second occurrence of
// the TensorChunk field, which protobufjs 7 does not merge into the first.

"use strict";

const fs = require("fs");
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
  if (token) meta.set("authorization", `Bearer ${token}`);
  if (secret) meta.set("shardtrain-deployment", secret);
  return meta;
}

function unary(client, method, request, meta, options = {}) {
  return new Promise((resolve, reject) =>
    client[method](request, meta, options, (error, response) => (error ? reject(error) : resolve(response))));
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
    const offset = Number(chunk.offset);
    if (offset !== current.filled) throw new Error(`chunk at ${offset}, expected ${current.filled}`);
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

// A float32 tensor's header and data, as one chunk named `name`.
function tensorChunk(name, values, shape) {
  const data = Buffer.from(Float32Array.from(values).buffer);
  return { header: { name, dtype: "DTYPE_FLOAT32", shape, nbytes: data.length, wire_nbytes: data.length,
                     encoding: "ENCODING_NONE" }, data, offset: 0 };
}

function float32s(encoded) {
  if (encoded.dtype !== "DTYPE_FLOAT32") throw new Error(`expected float32, got ${encoded.dtype}`);
  const bytes = Buffer.from(encoded.data, "base64");
  return new Float32Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length));
}

// A client-streaming call (Forward, Backward): the header and the one tensor in its first message.
function send(client, method, header, tensor, meta) {
  return new Promise((resolve, reject) => {
    const call = client[method](meta, (error) => (error ? reject(error) : resolve()));
    call.write({ header, tensor });
    call.end();
  });
}

async function fetchTensor(client, key, name, meta) {
  return assemble(await collect(client.FetchTensor({ key, name }, meta)))[name];
}

// The status code a call got ("OK" if it was not refused).
async function refusal(promise) {
  try {
    await promise;
    return "OK";
  } catch (error) {
    return grpc.status[error.code] || String(error.code);
  }
}

async function inspect(args, credentials, plain, owned) {
  const coordinator = new v1.CoordinatorService(args.coordinator, credentials);
  const listed = await unary(coordinator, "ListShards", {}, plain);
  const stages = args.stages.map((address) => new v1.ShardService(address, credentials));
  const described = [];
  for (const stage of stages) described.push(await unary(stage, "Describe", {}, plain));

  const rows = args.input;
  const key = { deployment_id: args.deployment_id, step: "1000000", microbatch: 0 };
  await send(stages[0], "Forward", { key, requires_grad: false },
             tensorChunk("activation", rows.flat(), [rows.length, rows[0].length]), owned);
  const output = { "@output": await fetchTensor(stages[stages.length - 1], key, "@output", owned) };

  const messages = await collect(stages[0].ReadOptimizerState({ deployment_id: args.deployment_id }, owned));
  const optimizer = {
    layout: JSON.parse(messages[0].header.layout),
    tensors: assemble(messages.filter((m) => m.tensor).map((m) => m.tensor)),
  };
  coordinator.close();
  stages.forEach((stage) => stage.close());
  return {
    shards: listed.shards.map((s) => s.address),
    described: described.map((d) => ({ address: d.address, stage: d.stage, deployment_id: d.deployment_id,
                                        layer_indexes: d.layer_indexes })),
    output, optimizer,
  };
}

async function train(args, credentials, plain, owned) {
  const deadline = () => ({ deadline: Date.now() + 30000 });
  const coordinator = new v1.CoordinatorService(args.coordinator, credentials);
  const listed = await unary(coordinator, "ListShards", {}, plain);
  // The deployment's stages, in order: each shard says which stage of which deployment it holds.
  const held = [];
  for (const shard of listed.shards) {
    const client = new v1.ShardService(shard.address, credentials);
    const described = await unary(client, "Describe", {}, plain);
    if (described.deployment_id === args.deployment_id && described.stage >= 0) held[described.stage] = client;
    else client.close();
  }
  if (held.length === 0 || held.includes(undefined)) throw new Error(`stages found: ${held.map((s) => !!s)}`);
  const first = held[0];
  const last = held[held.length - 1];
  const key = (step) => ({ deployment_id: args.deployment_id, step: String(step), microbatch: 0 });

  const losses = [];
  let inputGradient = null;
  let skip = null;
  for (const [index, batch] of args.batches.entries()) {
    const step = index + 1;
    const x = float32s(batch.x);
    // Gradients cleared first, and run only after the previous optimizer step settled on each stage.
    await send(first, "Forward", { key: key(step), requires_grad: true, zero_grad: true,
                                   after_optimizer_step: String(step - 1), input_requires_grad: step === 1 },
               tensorChunk("activation", x, batch.x.shape), owned);
    const output = await fetchTensor(last, key(step), "@output", owned);
    // The residual as the stage that reads it got it from stage 0 (kept for steps a call started).
    if (step === 1) skip = await fetchTensor(last, key(step), "skip", owned);
    const out = float32s(output);
    const y = float32s(batch.y);
    if (out.length !== y.length) throw new Error(`output of ${out.length} values, target of ${y.length}`);
    let loss = 0;
    const gradient = new Array(out.length);
    for (let i = 0; i < out.length; i++) {
      const difference = out[i] - y[i];
      loss += difference * difference;
      gradient[i] = (2 * difference) / out.length;
    }
    losses.push(loss / out.length);
    await send(last, "Backward", { key: key(step) }, tensorChunk("gradient", gradient, output.shape), owned);
    if (step === 1) inputGradient = await fetchTensor(first, key(step), "@input_grad", owned);
    await unary(first, "Step", { deployment_id: args.deployment_id, step: String(step),
                                 optimizer_step: String(step), backward_steps: [String(step)] }, owned);
  }
  // Step returns once the first stage settled it; a forward after it runs once every stage has.
  const steps = args.batches.length;
  const probe = args.batches[0].x;
  await send(first, "Forward", { key: key(steps + 1), requires_grad: false, after_optimizer_step: String(steps) },
             tensorChunk("activation", float32s(probe), probe.shape), owned);
  const after = await fetchTensor(last, key(steps + 1), "@output", owned);
  const weights = {};
  for (const stage of held) {
    Object.assign(weights, assemble(await collect(stage.ReadState({ deployment_id: args.deployment_id }, owned))));
  }

  // The same calls without what they need are refused: no token, no secret, no TLS.
  const refused = {
    no_token: await refusal(unary(coordinator, "ListShards", {}, new grpc.Metadata(), deadline())),
    no_token_stage: await refusal(collect(first.ReadState({ deployment_id: args.deployment_id },
                                                          metadata("", args.secret), deadline()))),
    no_secret: await refusal(collect(first.ReadState({ deployment_id: args.deployment_id }, plain, deadline()))),
    // A name the stage neither outputs nor reads.
    unknown: await refusal(collect(last.FetchTensor({ key: key(1), name: "nothing" }, owned, deadline()))),
  };
  const insecure = new v1.CoordinatorService(args.coordinator, grpc.credentials.createInsecure());
  refused.plaintext = await refusal(unary(insecure, "ListShards", {}, plain, deadline()));
  insecure.close();
  coordinator.close();
  held.forEach((stage) => stage.close());
  return { losses, input_gradient: inputGradient, skip, after, weights, refused };
}

async function main() {
  const chunks = [];
  for await (const piece of process.stdin) chunks.push(piece);
  const args = JSON.parse(Buffer.concat(chunks).toString());
  const credentials = args.ca ? grpc.credentials.createSsl(fs.readFileSync(args.ca))
    : grpc.credentials.createInsecure();
  const plain = metadata(args.token, "");
  const owned = metadata(args.token, args.secret);
  const answer = await (args.batches ? train : inspect)(args, credentials, plain, owned);
  console.log(JSON.stringify(answer));
}

main().catch((error) => {
  console.error(error.stack || String(error));
  process.exit(1);
});
