//! A proxy-wasm HTTP filter that makes the gateway filter's host calls on a streamed chat request
//! and decides nothing: it buffers the body, reads the headers and the body, sets fixed
//! `x-gateway-*` headers (the pool of bench/overhead.py; only `x-gateway-pool` when its plugin
//! configuration has `"upstream_headers": "routing"`, as the filter does), the facts' and the
//! usage's filter states, clears the route cache, and reads the response headers and chunks.
//! Built for wasm32 only, it measures what the gateway filter's design costs Envoy apart from the
//! filter's own computing: the share of the filter's CPU that no change inside the VM can remove.
//!
//! `make build` builds it; bench/overhead.py runs it as the target `filter-floor`:
//!
//! ```sh
//! python bench/overhead.py --rounds 9 --targets bare,filter-noop,filter,filter-floor --scenarios saturation --no-write-docs
//! ```

#[cfg(target_arch = "wasm32")]
mod floor {
    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, BufferType, ContextType, MapType};

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::<Root>::default() });
    }}

    #[derive(Default)]
    struct Root {
        routing: bool,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
            let config = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten();
            let value: Option<serde_json::Value> = config.and_then(|c| serde_json::from_slice(&c).ok());
            self.routing = value.is_some_and(|v| v["upstream_headers"] == "routing");
            true
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Http { routing: self.routing }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Http {
        /// Only `x-gateway-pool` of [`HEADERS`] (`upstream_headers: routing`).
        routing: bool,
    }

    impl Context for Http {}

    const FACTS: &[u8] = br#"{"v":1,"tenant":"bench","tier":"standard","model":"sim-model","pool":"pool_sim","prompt_tokens":40,"max_tokens":16,"nonce":"0123456789abcdef"}"#;
    const USAGE: &[u8] = br#"{"v":1,"status":200,"prompt_tokens":20,"completion_tokens":16,"cached_tokens":0,"ttft_us":900,"tpot_us":10,"duration_us":1000,"end_reason":"completed","usage_source":"upstream","stream":true}"#;
    const HEADERS: [(&str, &str); 8] = [
        ("x-gateway-tenant", "bench"),
        ("x-gateway-tier", "standard"),
        ("x-gateway-model", "sim-model"),
        ("x-gateway-pool", "pool_sim"),
        ("x-gateway-prompt-tokens", "40"),
        ("x-gateway-prompt-tokens-source", "estimate"),
        ("x-gateway-max-tokens", "16"),
        ("x-gateway-request-nonce", "0123456789abcdef"),
    ];

    impl HttpContext for Http {
        fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
            let _ = hostcalls::get_current_time();
            let _ = hostcalls::get_map_bytes(MapType::HttpRequestHeaders);
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, "authorization");
            if end_of_stream {
                Action::Continue
            } else {
                Action::Pause
            }
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if !end_of_stream {
                return Action::Pause;
            }
            let _ = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size);
            let _ = hostcalls::set_property(vec!["llm_gateway.request"], Some(FACTS));
            for (name, value) in
                HEADERS.into_iter().filter(|(name, _)| !self.routing || *name == "x-gateway-pool")
            {
                let _ =
                    hostcalls::set_map_value_bytes(MapType::HttpRequestHeaders, name, Some(value.as_bytes()));
            }
            let _ = hostcalls::call_foreign_function("clear_route_cache", None);
            Action::Continue
        }

        fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
            let _ = hostcalls::get_map_bytes(MapType::HttpResponseHeaders);
            Action::Continue
        }

        fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if body_size > 0 {
                let _ = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size);
            }
            if end_of_stream {
                let _ = hostcalls::get_current_time();
                let _ = hostcalls::set_property(vec!["llm_gateway.usage"], Some(USAGE));
            }
            Action::Continue
        }
    }
}
