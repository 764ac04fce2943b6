//! `wasm-bindgen` declarations of the Workflows runtime's JS API, the few
//! methods this crate calls, and [`WorkflowSteps`], the [`Steps`] of one
//! running instance.
//!
//! The shapes are Cloudflare's (`cloudflare:workers` `WorkflowStep`, the
//! `Workflow` binding and `WorkflowInstance`): `step.do(name, config,
//! callback)` with `config = {retries: {limit, delay, backoff}, timeout}`
//! (durations in milliseconds), `step.waitForEvent(name, {type, timeout})`
//! resolving to `{payload, type, timestamp}`, `binding.create({id,
//! params})`, `binding.get(id)`, `instance.status()` resolving to
//! `{status, error?, output?}` and `instance.sendEvent({type, payload})`.

use async_trait::async_trait;
use js_sys::{Function, Object, Promise, Reflect};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{future_to_promise, JsFuture};

use crate::run::{StepBody, StepOptions, Steps, INPUT_EVENT};

#[wasm_bindgen]
extern "C" {
    /// `console.log`: a line in the Worker's log per step, so a turn's
    /// progress can be followed (`wrangler tail`, `wrangler dev`).
    #[wasm_bindgen(js_namespace = console, js_name = log)]
    fn console_log(line: &str);

    /// The `step` argument of a `WorkflowEntrypoint`'s `run`.
    #[derive(Debug, Clone)]
    pub type WorkflowStep;

    #[wasm_bindgen(method, catch, js_name = "do")]
    fn do_step(
        this: &WorkflowStep,
        name: &str,
        config: &JsValue,
        callback: &Function,
    ) -> Result<Promise, JsValue>;

    #[wasm_bindgen(method, catch, js_name = waitForEvent)]
    fn wait_for_event(
        this: &WorkflowStep,
        name: &str,
        options: &JsValue,
    ) -> Result<Promise, JsValue>;

    /// A Workflow binding (`[[workflows]]` in `wrangler.toml`).
    #[derive(Debug, Clone)]
    pub type WorkflowBinding;

    #[wasm_bindgen(method, catch)]
    fn create(this: &WorkflowBinding, options: &JsValue) -> Result<Promise, JsValue>;

    #[wasm_bindgen(method, catch)]
    fn get(this: &WorkflowBinding, id: &str) -> Result<Promise, JsValue>;

    /// One instance of a Workflow.
    #[derive(Debug, Clone)]
    pub type WorkflowInstance;

    #[wasm_bindgen(method, catch)]
    fn status(this: &WorkflowInstance) -> Result<Promise, JsValue>;

    #[wasm_bindgen(method, catch, js_name = sendEvent)]
    fn send_event(this: &WorkflowInstance, event: &JsValue) -> Result<Promise, JsValue>;

    #[wasm_bindgen(js_name = setTimeout)]
    fn set_timeout(callback: &Function, ms: f64) -> JsValue;
}

/// The message of a JS error (or its string form).
pub fn js_message(value: &JsValue) -> String {
    Reflect::get(value, &JsValue::from_str("message"))
        .ok()
        .and_then(|m| m.as_string())
        .or_else(|| value.as_string())
        .unwrap_or_else(|| format!("{value:?}"))
}

/// A plain JS object from `(key, value)` pairs.
pub(crate) fn object(entries: &[(&str, JsValue)]) -> JsValue {
    let object = Object::new();
    for (key, value) in entries {
        // Setting a property on a fresh plain object cannot fail.
        let _ = Reflect::set(&object, &JsValue::from_str(key), value);
    }
    object.into()
}

/// Await a JS promise, with its rejection as a message.
pub(crate) async fn settle(promise: Result<Promise, JsValue>) -> Result<JsValue, String> {
    let promise = promise.map_err(|e| js_message(&e))?;
    JsFuture::from(promise).await.map_err(|e| js_message(&e))
}

/// Wait `ms` milliseconds (the runtime's `setTimeout`).
pub(crate) async fn sleep_ms(ms: u64) {
    let promise = Promise::new(&mut |resolve, _reject| {
        set_timeout(&resolve, ms as f64);
    });
    let _ = JsFuture::from(promise).await;
}

impl WorkflowBinding {
    /// `create({id, params})`.
    pub async fn create_instance(&self, id: &str, params: &JsValue) -> Result<(), String> {
        let options = object(&[("id", JsValue::from_str(id)), ("params", params.clone())]);
        settle(self.create(&options)).await.map(|_| ())
    }

    /// `get(id)`.
    pub async fn instance(&self, id: &str) -> Result<WorkflowInstance, String> {
        settle(self.get(id)).await.map(JsCast::unchecked_into)
    }
}

impl WorkflowInstance {
    /// `status()`: `(status, error message, output)`.
    pub async fn current_status(&self) -> Result<(String, Option<String>, JsValue), String> {
        let status = settle(self.status()).await?;
        let field = |name: &str| Reflect::get(&status, &JsValue::from_str(name)).ok();
        let state = field("status")
            .and_then(|s| s.as_string())
            .unwrap_or_else(|| "unknown".into());
        let error = field("error")
            .filter(|e| !e.is_undefined() && !e.is_null())
            .map(|e| js_message(&e));
        let output = field("output").unwrap_or(JsValue::UNDEFINED);
        Ok((state, error, output))
    }

    /// `sendEvent({type: INPUT_EVENT, payload})`, the payload a JSON string.
    pub async fn send_input(&self, payload_json: &str) -> Result<(), String> {
        let event = object(&[
            ("type", JsValue::from_str(INPUT_EVENT)),
            ("payload", JsValue::from_str(payload_json)),
        ]);
        settle(self.send_event(&event)).await.map(|_| ())
    }
}

/// The [`Steps`] of one running instance.
#[derive(Debug, Clone)]
pub struct WorkflowSteps {
    step: WorkflowStep,
}

impl WorkflowSteps {
    /// Steps over the `step` a `run` was given.
    pub fn new(step: WorkflowStep) -> Self {
        Self { step }
    }
}

#[async_trait(?Send)]
impl Steps for WorkflowSteps {
    async fn run(
        &self,
        name: &str,
        options: StepOptions,
        body: StepBody,
    ) -> Result<String, String> {
        let config = object(&[
            (
                "retries",
                object(&[
                    ("limit", JsValue::from_f64(f64::from(options.retries))),
                    ("delay", JsValue::from_f64(options.retry_delay_ms as f64)),
                    ("backoff", JsValue::from_str("constant")),
                ]),
            ),
            ("timeout", JsValue::from_f64(options.timeout_ms as f64)),
        ]);
        // Called once per attempt; each attempt is a fresh future.
        let callback = Closure::<dyn FnMut(JsValue) -> Promise>::new(move |_ctx: JsValue| {
            let attempt = body();
            future_to_promise(async move {
                attempt
                    .await
                    .map(|json| JsValue::from_str(&json))
                    .map_err(|message| js_sys::Error::new(&message).into())
            })
        });
        let output = settle(
            self.step
                .do_step(name, &config, callback.as_ref().unchecked_ref()),
        )
        .await;
        drop(callback);
        match &output {
            Ok(_) => console_log(&format!("workflow step {name}: done")),
            Err(e) => console_log(&format!("workflow step {name}: failed: {e}")),
        }
        let output = output?;
        output
            .as_string()
            .ok_or_else(|| format!("step {name} returned a non-string output"))
    }

    async fn wait_input(&self, name: &str, timeout_ms: u64) -> Result<String, String> {
        let options = object(&[
            ("type", JsValue::from_str(INPUT_EVENT)),
            ("timeout", JsValue::from_f64(timeout_ms as f64)),
        ]);
        console_log(&format!(
            "workflow step {name}: waiting for a {INPUT_EVENT} event"
        ));
        let event = settle(self.step.wait_for_event(name, &options)).await;
        if let Err(e) = &event {
            console_log(&format!("workflow step {name}: no event: {e}"));
        }
        let event = event?;
        let payload =
            Reflect::get(&event, &JsValue::from_str("payload")).map_err(|e| js_message(&e))?;
        payload
            .as_string()
            .ok_or_else(|| format!("the {INPUT_EVENT} event {name} carries no JSON string"))
    }
}
