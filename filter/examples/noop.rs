//! A proxy-wasm HTTP filter that does nothing: every callback returns at once (Continue). Built
//! for wasm32 only (on the host it is empty), it measures the floor of any proxy-wasm filter in
//! Envoy's V8 runtime: the VM entries of each request's callbacks, with no host calls and no work.
//!
//! ```sh
//! cargo build --release --target wasm32-wasip1 -p gateway-filter --example noop
//! python bench/overhead.py --rounds 3 --targets bare,filter,filter-noop --scenarios saturation --no-write-docs
//! ```

#[cfg(target_arch = "wasm32")]
mod noop {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::ContextType;

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
            true
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Http))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Http;

    impl Context for Http {}

    impl HttpContext for Http {}
}
