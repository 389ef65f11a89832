mod smoke { #[test] fn builds() { assert!(m3c_tests::m3c_bin().exists(), "m3c binary missing"); } }
