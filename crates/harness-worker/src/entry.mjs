// The Worker's entry module: everything worker-build made from the Rust
// crate (the fetch handler, the SessionObject Durable Object) plus the one
// thing Rust cannot declare, the Workflow class. The Workflows runtime
// needs a JS class extending WorkflowEntrypoint; its `run` hands the event
// and the step to Rust (`run_turn_workflow` in src/turns.rs), which drives
// the turn. worker-build attaches exported Rust functions to the default
// entrypoint's prototype, which is where the call finds it.
import { WorkflowEntrypoint } from "cloudflare:workers";
import Worker from "../build/index.js";

export * from "../build/index.js";
export default Worker;

export class TurnWorkflow extends WorkflowEntrypoint {
  async run(event, step) {
    return await Worker.prototype.run_turn_workflow(event, step, this.env);
  }
}
