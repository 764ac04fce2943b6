//! A real headless Chromium (Debian's `chromium` driven through
//! `chromedriver` over WebDriver) for the page tests (`tests/web.rs`, the
//! chat example in `tests/chat.rs`), and what they do with it the way a
//! person would: wait for text, click, type, take screenshots.

#![allow(dead_code)]

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use harness_testkit::skip_or_fail;
use serde_json::{json, Value};

use super::server::Serve;

pub const WAIT: Duration = Duration::from_secs(120);

/// A headless Chromium under its own chromedriver.
pub struct Browser {
    driver: Child,
    pub client: Client,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    /// Kill chromedriver's whole process group: killing chromedriver alone
    /// orphans the browser it started, whose pages then reconnect (the
    /// transcript's `EventSource`) to whatever server takes their old port
    /// next, another test's among them.
    fn drop(&mut self) {
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A browser window of `width` × `height`, or a skip.
pub async fn browser(width: u32, height: u32) -> Option<Browser> {
    let chromium = std::env::var("HARNESS_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let chromedriver =
        std::env::var("HARNESS_CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
    if !std::path::Path::new(&chromium).is_file() || !std::path::Path::new(&chromedriver).is_file()
    {
        skip_or_fail("no chromium/chromedriver (apt-get install chromium chromium-driver, or cargo xtask deps)");
        return None;
    }
    let port = free_port();
    let driver = Command::new(&chromedriver)
        .arg(format!("--port={port}"))
        // Its own process group, with the browser it starts: see `Drop`.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver starts");
    let profile = tempfile::tempdir().unwrap();
    let caps = json!({
        "goog:chromeOptions": {
            "binary": chromium,
            // As root, headless, offline: no sandbox, no background traffic
            // to the outside (this machine reaches no other host).
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-default-apps",
                "--disable-extensions",
                format!("--user-data-dir={}", profile.path().display()),
                format!("--window-size={width},{height}"),
            ]
        }
    });
    let caps = match caps {
        Value::Object(map) => map,
        _ => unreachable!(),
    };
    let url = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    let client = loop {
        let attempt = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps.clone())
            .connect(&url)
            .await;
        match attempt {
            Ok(client) => break client,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("chromedriver did not start a browser: {e}"),
        }
    };
    Some(Browser {
        driver,
        client,
        _profile: profile,
    })
}

/// Where screenshots go: `$HARNESS_CACHE/screenshots/<group>`.
pub fn screenshot_dir(group: &str) -> PathBuf {
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    let dir = PathBuf::from(cache).join("screenshots").join(group);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A screenshot of the web page's tests, `screenshots/web/<name>.png`.
pub async fn screenshot(client: &Client, name: &str) {
    screenshot_to(client, "web", name).await
}

/// A screenshot into `screenshots/<group>/<name>.png`.
pub async fn screenshot_to(client: &Client, group: &str, name: &str) {
    let png = client.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let path = screenshot_dir(group).join(format!("{name}.png"));
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {}", path.display());
}

/// The text of the first element matching `css`, or "".
pub async fn text_of(client: &Client, css: &str) -> String {
    match client.find(Locator::Css(css)).await {
        Ok(el) => el.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

pub async fn count(client: &Client, css: &str) -> usize {
    client
        .find_all(Locator::Css(css))
        .await
        .map(|v| v.len())
        .unwrap_or(0)
}

/// Wait until the first element matching `css` contains `needle`.
pub async fn wait_text(serve: &Serve, client: &Client, css: &str, needle: &str) -> String {
    let started = Instant::now();
    loop {
        let text = text_of(client, css).await;
        if text.contains(needle) {
            return text;
        }
        if started.elapsed() > WAIT {
            let page = text_of(client, "body").await;
            panic!(
                "no {css:?} containing {needle:?} in {WAIT:?}; the page shows:\n{page}\nserver log:\n{}",
                serve.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first element matching `css` once it is shown and enabled, the way a
/// person would use it. The page swaps views after async requests (signing
/// in fetches the session before the composer is shown), so an element can
/// be in the DOM and still hidden; typing into it then fails with "element
/// not interactable".
pub async fn interactable(client: &Client, css: &str) -> fantoccini::elements::Element {
    let started = Instant::now();
    loop {
        if let Ok(el) = client.find(Locator::Css(css)).await {
            let shown = el.is_displayed().await.unwrap_or(false);
            let enabled = el.is_enabled().await.unwrap_or(false);
            if shown && enabled {
                return el;
            }
        }
        if started.elapsed() > WAIT {
            let page = text_of(client, "body").await;
            panic!("no shown and enabled {css:?} in {WAIT:?}; the page shows:\n{page}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn click(client: &Client, css: &str) {
    interactable(client, css).await.click().await.unwrap();
}

pub async fn type_into(client: &Client, css: &str, text: &str) {
    let el = interactable(client, css).await;
    el.clear().await.unwrap();
    el.send_keys(text).await.unwrap();
}
