// Runs a wasm32-wasip1 command module (its `_start`) under node's V8 with every non-WASI import
// stubbed to throw: filter/examples/phase_cost.rs built for wasm32 (it also exports the filter's
// `_initialize`, which node's WASI refuses beside `_start`, so it is left out here).
//
//   cargo build --release --target wasm32-wasip1 -p gateway-filter --example phase_cost
//   node --no-liftoff tools/run_wasi.mjs target/wasm32-wasip1/release/examples/phase_cost.wasm [ARGS]
//
// `--no-liftoff` compiles every function with TurboFan up front, as Envoy's V8 does (its flags
// string in the envoy binary); add `--cpu-prof` for a profile that names the module's functions.
import { readFileSync } from 'node:fs';
import { WASI } from 'node:wasi';

const [path, ...args] = process.argv.slice(2);
const wasi = new WASI({ version: 'preview1', args: [path, ...args], env: {} });
const mod = await WebAssembly.compile(readFileSync(path));
const imports = { wasi_snapshot_preview1: wasi.wasiImport };
for (const imp of WebAssembly.Module.imports(mod)) {
  if (imp.module !== 'wasi_snapshot_preview1') {
    imports[imp.module] ??= {};
    imports[imp.module][imp.name] = () => { throw new Error(`host call ${imp.module}.${imp.name}`); };
  }
}
const instance = await WebAssembly.instantiate(mod, imports);
const exports = {};
for (const name of Object.keys(instance.exports)) {
  if (name !== '_initialize') exports[name] = instance.exports[name];
}
wasi.start({ exports });
