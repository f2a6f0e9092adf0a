//! Fair sharing between the tenants of a tier: the virtual token counter (VTC) of Sheng et al.,
//! "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant's counter is the service
//! it attained, in weighted tokens: `prompt tokens + output_token_weight × completion tokens`,
//! divided by its weight. The queue serves the backlogged tenant with the least counter. A
//! tenant that becomes backlogged has its counter lifted to the least counter of the tenants
//! already backlogged (or, with none, to that of the last tenant whose queue emptied), so that
//! time spent idle is not saved up as credit against the others.

use std::collections::{BTreeMap, HashMap};

/// The tenants' counters of one pool.
#[derive(Debug, Clone)]
pub struct Fairness {
    counters: HashMap<String, f64>,
    weights: BTreeMap<String, f64>,
    output_token_weight: f64,
    /// The counter of the last tenant whose queue emptied.
    last_left: f64,
}

impl Fairness {
    /// Counters starting at 0, with per-tenant `weights` (default 1; validated > 0 at load)
    /// and the weight of an output token against a prompt token.
    pub fn new(weights: BTreeMap<String, f64>, output_token_weight: f64) -> Self {
        Self { counters: HashMap::new(), weights, output_token_weight, last_left: 0.0 }
    }

    /// A tenant's weight (1 unless configured).
    pub fn weight(&self, tenant: &str) -> f64 {
        self.weights.get(tenant).copied().filter(|w| *w > 0.0).unwrap_or(1.0)
    }

    /// A tenant's counter (0 for one never served).
    pub fn counter(&self, tenant: &str) -> f64 {
        self.counters.get(tenant).copied().unwrap_or(0.0)
    }

    /// `tenant` becomes backlogged while `others` are.
    pub fn backlogged<'a>(&mut self, tenant: &str, others: impl Iterator<Item = &'a str>) {
        let floor = others.map(|o| self.counter(o)).reduce(f64::min).unwrap_or(self.last_left);
        let c = self.counters.entry(tenant.to_owned()).or_insert(0.0);
        *c = c.max(floor);
    }

    /// `tenant`'s last queued request left the queue.
    pub fn left(&mut self, tenant: &str) {
        self.last_left = self.counter(tenant);
    }

    /// Charges a dispatched request's prompt tokens.
    pub fn charge_prompt(&mut self, tenant: &str, tokens: u64) {
        self.charge(tenant, tokens as f64);
    }

    /// Charges a finished request's completion tokens (`usage.completion_tokens`).
    pub fn charge_output(&mut self, tenant: &str, tokens: u64) {
        self.charge(tenant, self.output_token_weight * tokens as f64);
    }

    fn charge(&mut self, tenant: &str, service: f64) {
        let w = self.weight(tenant);
        *self.counters.entry(tenant.to_owned()).or_insert(0.0) += service / w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_weighted_tokens() {
        let mut f = Fairness::new(BTreeMap::from([("gold".to_owned(), 4.0)]), 2.0);
        f.charge_prompt("gold", 100);
        f.charge_output("gold", 50);
        f.charge_prompt("plain", 100);
        assert_eq!(f.counter("gold"), 50.0);
        assert_eq!(f.counter("plain"), 100.0);
        assert_eq!(f.counter("never"), 0.0);
    }

    #[test]
    fn idle_time_is_no_credit() {
        let mut f = Fairness::new(BTreeMap::new(), 1.0);
        f.charge_prompt("busy", 1000);
        f.charge_prompt("other", 400);
        // A tenant arriving while "busy" and "other" are backlogged starts at the least of them.
        f.backlogged("new", ["busy", "other"].into_iter());
        assert_eq!(f.counter("new"), 400.0);
        // One that arrives to an empty tier starts at the last one served.
        f.left("busy");
        f.backlogged("late", std::iter::empty());
        assert_eq!(f.counter("late"), 1000.0);
        // A lift never lowers a counter.
        f.backlogged("busy", ["other"].into_iter());
        assert_eq!(f.counter("busy"), 1000.0);
    }
}
