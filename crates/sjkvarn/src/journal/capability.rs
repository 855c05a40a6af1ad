//! Which journal settings each backend runs, as data: one table that every backend's
//! constructor asks, that Python shows as `sjkvarn.backends()` and `docs/journal.md` prints.
//! A refusal is written here once and reads the same on every backend, and a gap (a setting a
//! backend does not run yet) is named in the table instead of being discovered at run time.
//!
//! Values are written as a user writes them in `sjkvarn.Config`: names (`"q8_0"`), `"True"` /
//! `"False"`, numbers, `"lo..hi"` for an inclusive range of numbers, `"K/V"` for any pair of
//! staging kinds, and `"any"`.

use super::config::{CacheConfig, MAX_EXACT_RECENT};
use super::presets::{JournalPreset, DEFAULT_JOURNAL, REFERENCE_JOURNAL};
use crate::codec::extension::balance::{BalanceConfig, BalanceMode, BalanceStat};
use crate::error::{CacheError, CacheResult};

/// A backend that runs the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// `backend::cpu`: the reference, host memory.
    Cpu,
    /// `backend::cuda`: device memory (feature `cuda`).
    Cuda,
    /// `backend::paged`: an engine's block pages (vLLM); one block is one record.
    Paged,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Cpu, Backend::Cuda, Backend::Paged];

    pub const fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Paged => "paged",
        }
    }

    pub fn from_name(name: &str) -> CacheResult<Self> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == name)
            .ok_or_else(|| {
                CacheError::InvalidConfig(format!(
                    "backend must be 'cpu', 'cuda' or 'paged', got '{name}'"
                ))
            })
    }
}

/// A journal setting whose values differ between backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Setting {
    /// How ring rows are stored (`Config.staging`).
    Staging,
    /// Keys stored minus the sink's mean key (`Config.centre_keys`).
    CentreKeys,
    /// Unsealed tokens kept after a seal (`Config.min_tail`).
    MinTail,
    /// Unsealed span that triggers a seal (`Config.max_tail`).
    MaxTail,
    /// Newest positions read in fp16 (`Config.exact_recent`).
    ExactRecent,
    /// Leading positions kept exact (`Config.sink`).
    Sink,
    /// How the sink is stored (`Config.sink_type`).
    SinkType,
    /// How records are coded (`Config.k_bits`, `v_bits`, `body`).
    Body,
    /// Sinkhorn balancing before coding (`Config.mode`, `stat`, `passes`).
    Balance,
}

impl Setting {
    pub const ALL: [Setting; 9] = [
        Setting::Staging,
        Setting::CentreKeys,
        Setting::MinTail,
        Setting::MaxTail,
        Setting::ExactRecent,
        Setting::Sink,
        Setting::SinkType,
        Setting::Body,
        Setting::Balance,
    ];

    /// The `sjkvarn.Config` field (or fields) the setting is written in.
    pub const fn name(self) -> &'static str {
        match self {
            Setting::Staging => "staging",
            Setting::CentreKeys => "centre_keys",
            Setting::MinTail => "min_tail",
            Setting::MaxTail => "max_tail",
            Setting::ExactRecent => "exact_recent",
            Setting::Sink => "sink",
            Setting::SinkType => "sink_type",
            Setting::Body => "body",
            Setting::Balance => "balance",
        }
    }

    /// The setting's value in `config`, as a user writes it (`None` where the table's values
    /// are descriptions that the backend's own checks apply, as for record codings).
    fn value_of(self, config: &CacheConfig) -> Option<String> {
        Some(match self {
            Setting::Staging => config.staging_name(),
            Setting::CentreKeys => python_bool(config.centre_keys).into(),
            Setting::MinTail => config.min_tail.to_string(),
            Setting::MaxTail => config.max_tail.to_string(),
            Setting::ExactRecent => config.exact_recent.to_string(),
            Setting::Sink => config.sink.to_string(),
            Setting::SinkType => config.sink_type.name().into(),
            Setting::Balance => balance_name(&config.balance),
            Setting::Body => return None,
        })
    }
}

fn python_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// `"mode stat"`, with the passes when they are not the format's 16.
fn balance_name(b: &BalanceConfig) -> String {
    let mode = match b.mode {
        BalanceMode::Final => "final",
        BalanceMode::Best => "best",
    };
    let stat = match b.stat {
        BalanceStat::Std => "std",
        BalanceStat::Rms => "rms",
    };
    if b.passes == BalanceConfig::default().passes {
        format!("{mode} {stat}")
    } else {
        format!("{mode} {stat} {} passes", b.passes)
    }
}

/// One row of the table: a setting and the values each backend runs.
struct Row {
    setting: Setting,
    cpu: &'static [&'static str],
    cuda: &'static [&'static str],
    paged: &'static [&'static str],
}

const EXACT_RECENT_RANGE: &str = {
    assert!(MAX_EXACT_RECENT == 4096, "the table's exact_recent range");
    "0..4096"
};

/// The table. The paged journal's ring is its open block: the positions of the block being
/// filled (0..127 of them) are exact fp16 rows and every full block is a record.
const TABLE: [Row; 9] = [
    Row {
        setting: Setting::Staging,
        cpu: &["tq6_0", "q8_0", "f16", "K/V", "auto"],
        cuda: &["tq6_0"],
        paged: &["f16"],
    },
    Row {
        setting: Setting::CentreKeys,
        cpu: &["False", "True"],
        cuda: &["False"],
        paged: &["False"],
    },
    Row {
        setting: Setting::MinTail,
        cpu: &["any"],
        cuda: &["any"],
        paged: &["0"],
    },
    Row {
        setting: Setting::MaxTail,
        cpu: &["any"],
        cuda: &["any"],
        paged: &["127"],
    },
    Row {
        setting: Setting::ExactRecent,
        cpu: &[EXACT_RECENT_RANGE],
        cuda: &["0"],
        paged: &["0"],
    },
    Row {
        setting: Setting::Sink,
        cpu: &["64..65536"],
        cuda: &["128"],
        paged: &["128"],
    },
    Row {
        setting: Setting::SinkType,
        cpu: &["f16", "inherit"],
        cuda: &["f16"],
        paged: &["f16"],
    },
    Row {
        setting: Setting::Body,
        cpu: &[
            "scalar 2..4",
            "trellis 3/3, 3/2, 2/2",
            "scalar 5, 6, 8 (extension)",
        ],
        cuda: &["scalar 2..4", "trellis 3/3, 3/2, 2/2"],
        paged: &["scalar 2..4", "trellis 3/3, 3/2, 2/2"],
    },
    Row {
        setting: Setting::Balance,
        cpu: &["any"],
        cuda: &["final std"],
        paged: &["final std"],
    },
];

/// The values `backend` runs for `setting`.
pub fn runs(backend: Backend, setting: Setting) -> &'static [&'static str] {
    let row = TABLE
        .iter()
        .find(|r| r.setting == setting)
        .expect("every setting has a row");
    match backend {
        Backend::Cpu => row.cpu,
        Backend::Cuda => row.cuda,
        Backend::Paged => row.paged,
    }
}

/// One backend's column of the table: each setting and the values it runs.
pub type Column = Vec<(Setting, &'static [&'static str])>;

/// The whole table: backend -> setting -> the values it runs, in table order.
pub fn backends() -> Vec<(Backend, Column)> {
    Backend::ALL
        .into_iter()
        .map(|b| (b, Setting::ALL.map(|s| (s, runs(b, s))).to_vec()))
        .collect()
}

/// Whether `value` is one of `runs` (names, `"any"`, `"lo..hi"`, `"K/V"` for a pair).
fn admits(runs: &[&str], value: &str) -> bool {
    runs.iter().any(|&r| {
        if r == "any" || r == value {
            return true;
        }
        if r == "K/V" {
            return value.contains('/');
        }
        match (r.split_once(".."), value.parse::<usize>()) {
            (Some((lo, hi)), Ok(v)) => {
                lo.parse::<usize>().is_ok_and(|lo| v >= lo)
                    && hi.parse::<usize>().is_ok_and(|hi| v <= hi)
            }
            _ => false,
        }
    })
}

/// The refusal of a value `backend` does not run; worded once for every backend.
pub fn refusal(backend: Backend, setting: Setting, value: &str) -> String {
    format!(
        "`{}={}` is not run by the {} backend; it runs: {}",
        setting.name(),
        quoted(setting, value),
        backend.name(),
        runs(backend, setting).join(", ")
    )
}

fn quoted(setting: Setting, value: &str) -> String {
    match setting {
        Setting::Staging | Setting::SinkType | Setting::Balance => format!("'{value}'"),
        _ => value.to_string(),
    }
}

/// Checks every setting of `config` that `backend` may not run; the first one it does not
/// run is an `InvalidConfig` error worded by [`refusal`]. Record codings are checked by the
/// backend's record layouts (the table lists them).
pub fn check(backend: Backend, config: &CacheConfig) -> CacheResult<()> {
    for setting in Setting::ALL {
        let Some(value) = setting.value_of(config) else {
            continue;
        };
        if !admits(runs(backend, setting), &value) {
            return Err(CacheError::InvalidConfig(refusal(backend, setting, &value)));
        }
    }
    Ok(())
}

/// The journal preset a backend runs by default: the product's [`DEFAULT_JOURNAL`] where the
/// backend runs every one of its settings, else the reference codec's.
pub fn journal_for(backend: Backend) -> JournalPreset {
    let runs_preset = |p: &JournalPreset| {
        let staging = if p.k_staging == p.v_staging {
            p.k_staging.name().to_string()
        } else {
            format!("{}/{}", p.k_staging.name(), p.v_staging.name())
        };
        [
            (Setting::Staging, staging),
            (Setting::CentreKeys, python_bool(p.centre_keys).to_string()),
            (Setting::MinTail, p.min_tail.to_string()),
            (Setting::MaxTail, p.max_tail.to_string()),
            (Setting::ExactRecent, p.exact_recent.to_string()),
        ]
        .iter()
        .all(|(s, v)| admits(runs(backend, *s), v))
    };
    if runs_preset(&DEFAULT_JOURNAL) {
        DEFAULT_JOURNAL
    } else {
        REFERENCE_JOURNAL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::{LayerCoding, Staging};

    fn config() -> CacheConfig {
        CacheConfig::recommended(1, 2, 1, 128, LayerCoding::scalar(4, 4), 4096)
    }

    #[test]
    fn the_cpu_runs_every_valid_configuration_of_its_presets() {
        check(Backend::Cpu, &config()).unwrap();
        check(Backend::Cpu, &config().with_journal(REFERENCE_JOURNAL)).unwrap();
        let mut c = config();
        (c.k_staging, c.v_staging) = (Staging::Q8_0, Staging::Tq6);
        c.exact_recent = 4096;
        check(Backend::Cpu, &c).unwrap();
    }

    #[test]
    fn a_refusal_names_the_setting_the_value_and_what_runs() {
        let err = check(Backend::Cuda, &config()).unwrap_err().to_string();
        assert!(
            err.contains("`staging='q8_0'` is not run by the cuda backend; it runs: tq6_0"),
            "{err}"
        );
        let mut c = config().with_journal(REFERENCE_JOURNAL);
        check(Backend::Cuda, &c).unwrap();
        c.centre_keys = true;
        let err = check(Backend::Cuda, &c).unwrap_err().to_string();
        assert!(
            err.contains("`centre_keys=True` is not run by the cuda backend; it runs: False"),
            "{err}"
        );
        c.centre_keys = false;
        c.sink = 256;
        assert!(check(Backend::Cuda, &c)
            .unwrap_err()
            .to_string()
            .contains("`sink=256`"));
    }

    #[test]
    fn each_backend_gets_the_default_journal_only_where_it_runs_it() {
        assert_eq!(journal_for(Backend::Cpu), DEFAULT_JOURNAL);
        assert_eq!(journal_for(Backend::Cuda), REFERENCE_JOURNAL);
    }

    #[test]
    fn ranges_pairs_and_names_are_admitted_as_written() {
        assert!(admits(&["0..4096"], "4096") && !admits(&["0..4096"], "4097"));
        assert!(admits(&["K/V"], "q8_0/tq6_0") && !admits(&["K/V"], "q8_0"));
        assert!(admits(&["any"], "12") && !admits(&["False"], "True"));
    }

    #[test]
    fn the_table_has_every_backend_and_setting() {
        let table = backends();
        assert_eq!(table.len(), Backend::ALL.len());
        for (b, row) in &table {
            assert_eq!(row.len(), Setting::ALL.len(), "{}", b.name());
            assert!(row.iter().all(|(_, v)| !v.is_empty()));
        }
    }
}
